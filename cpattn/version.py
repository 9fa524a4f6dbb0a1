"""The version of cpattn (one place: the package, the fingerprint ranks compare, and the build read it)."""

__version__ = "0.1.0"
