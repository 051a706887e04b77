"""pagedserve's OpenAI-compatible HTTP gateway and CLI. Depends on `engine`, never the reverse."""
