import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory):
    from shared.model.default_model import build_default_model

    return build_default_model(tmp_path_factory.mktemp("default_model"))
