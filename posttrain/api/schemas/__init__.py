"""Wire request models that mirror the SDK's JSON, and their conversion to domain types.

Requests are pydantic models (errors name the field); explicit nulls mean "absent" (api.md 0.3).
Everything is normalised here into posttrain.types, once; the service never sees a wire object.
One module per API area: wire (shared bases), sessions, samples, losses (forward-backward),
steps (optim-step, weights-sync, sample).
"""
