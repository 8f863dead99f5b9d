"""HTTP edge of the OpenAI-compatible surface: completions and models over the service."""
