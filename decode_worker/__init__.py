"""pdserve decode_worker package."""
