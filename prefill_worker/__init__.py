"""pdserve prefill_worker package."""
