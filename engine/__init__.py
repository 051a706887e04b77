"""pagedserve's engine: scheduling, the paged KV cache and model execution. No HTTP here."""
