"""The Tinker dialect's rules over the one set of services: a Tinker client session, training
run, sampler or future is a name for resources, training sessions and operations the Together
surface also serves (no second scheduler, no second engine path)."""
