"""The jax/flax pair is checked before anything imports flax: a pair that does not import is named, with the
fix."""

from __future__ import annotations

from importlib import metadata

from nnx_shard.errors import IncompatibleVersionsError


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def check_versions() -> None:
    """Imports flax; when it cannot import with the installed jax, raises IncompatibleVersionsError naming
    both.

    flax 0.12.8 declares any jax >= 0.10.0 but does not import with jax 0.12
    (``jax.experimental.hijax`` lost ``HiPrimitive``: an AttributeError); flax
    0.12.12 does. What a mismatched pair raises while importing is whatever the
    missing piece makes it (ImportError, AttributeError, TypeError, NameError):
    each is named the same way.

    >>> check_versions()  # the installed pair imports
    """
    try:
        import flax.nnx  # noqa: F401
    except (ImportError, AttributeError, TypeError, NameError) as e:
        raise IncompatibleVersionsError(
            f"flax {_version('flax')} does not import with jax {_version('jax')} (jaxlib "
            f"{_version('jaxlib')}): "
            f"{type(e).__name__}: {e}. Install a pair that imports: `pip install -U flax` (flax >= 0.12.12 "
            "with jax 0.12), or "
            f"`pip install 'jax<0.12' 'jaxlib<0.12'` for an older flax."
        ) from e


check_versions()
