"""The package version (its own module so that library code can read it without importing the package's
lazy export table)."""
__version__ = "0.1.0"
