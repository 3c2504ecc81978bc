import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxinfer import runtime  # noqa: E402
from jaxinfer.synthetic import SyntheticSpec, write_model  # noqa: E402

runtime.enable_compilation_cache()


@pytest.fixture
def make_model(tmp_path):
    """make_model(**spec_fields) -> path of a freshly written synthetic GGUF model."""

    def make(name="tiny.gguf", **fields):
        return write_model(str(tmp_path / name), SyntheticSpec(**fields))

    return make


@pytest.fixture(scope="session")
def default_model():
    """The real default model (SmolLM2-135M-Instruct Q4_1), installed by the README's install command."""
    from jaxinfer import engine

    return engine.load_model(engine.default_model_path())


@pytest.fixture(scope="session")
def default_model_exact():
    """The default model computing with its Q4_1 weights dequantized to f32: llama.cpp's F32 reference rows."""
    from jaxinfer import engine

    return engine.load_model(engine.default_model_path(), exact=True)


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices {jax.devices()}"
