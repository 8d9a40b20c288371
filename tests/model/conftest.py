import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory):
    from shared.model.default_model import build_default_model

    return build_default_model(tmp_path_factory.mktemp("default_model"))


@pytest.fixture(params=["portable", "avx2", "avx512", "avx512vnni", "avx512bf16"])
def kernel_isa(request):
    """Each native-kernel test once per ISA variant of the kernels (`build_kernels`): the
    variant loaded for the test (and the default one after it); one this CPU cannot run is
    skipped with the CPU flags it lacks. Fails when a kernel call during the test ran another
    variant's code (`cpu_kernels.calls`, keyed by what the library reports it was built for)."""
    import collections

    from shared.model import build_kernels, cpu_kernels

    name = request.param
    lacks = build_kernels.missing(name)
    if lacks:
        pytest.skip(f"this CPU cannot run the {name} kernels: it lacks {' '.join(lacks)}")
    try:
        assert cpu_kernels.use(name) == name  # the library's own report of its code paths
        before = collections.Counter(cpu_kernels.calls)
        yield name
        ran = {v for v, _ in cpu_kernels.calls - before}
        assert ran <= {name}, f"kernels of {ran - {name}} ran under the {name} variant"
    finally:
        cpu_kernels.use(None)
