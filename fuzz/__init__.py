"""Coverage-guided fuzz targets for mmadmit's native code (RELIABILITY.md)."""
