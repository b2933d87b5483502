"""`pagedmla serve`: the OpenAI-compatible HTTP server over an `OnlineEngine`."""
