import pytest


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    """The random-weight demo checkpoint (real tokenizer), written once per test session."""
    from engine.loading.demo_model import write_demo_model

    path = str(tmp_path_factory.mktemp("loadgen-demo"))
    write_demo_model(path, seed=0)
    return path
