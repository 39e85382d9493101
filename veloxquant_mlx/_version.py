"""The package version (its own module so that library code can read it without importing the package's
lazy export table)."""
__version__ = "0.1.0"
# deprecated aliases (the `_DEPRECATED` tables of the package and its subpackages) are removed in this version
DEPRECATED_UNTIL = "0.2.0"
