"""The Tinker-native wire surface (/api/v1): its protobuf schema, codec and routes."""
