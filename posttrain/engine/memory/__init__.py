"""Memory: resident bytes of resources and sessions, the estimated peak of an operation pass,
and the free headroom of a device.
"""
