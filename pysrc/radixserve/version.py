"""radixserve's version, in a module of its own so that any layer can read it without importing
the package root (which sits above everything: it exposes the offline Engine)."""
__version__ = "0.1.0"
