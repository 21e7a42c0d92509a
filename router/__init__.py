"""pdserve router package."""
