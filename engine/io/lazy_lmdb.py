"""The lmdb package, imported where a database is first opened: a machine without it (a GPU image
running the engine on in-memory data) still imports the engine."""
from ..errors import DataError


class _LazyLmdb:
    """Stands for the lmdb module; the first attribute read imports it (or says how to get it)."""

    _module = None

    def __getattr__(self, name):
        if self._module is None:
            try:
                import lmdb as module
            except ImportError as e:
                raise DataError(f"reading or writing an LMDB database needs the lmdb package "
                                f"({e}): pip install lmdb") from None
            self._module = module
        return getattr(self._module, name)


lmdb = _LazyLmdb()
