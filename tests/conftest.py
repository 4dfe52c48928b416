import pytest
import torch


def pytest_collection_modifyitems(config, items):
    have_cuda = torch.cuda.is_available()
    ngpu = torch.cuda.device_count() if have_cuda else 0
    for item in items:
        if "gpu" in item.keywords and not have_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and ngpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))
