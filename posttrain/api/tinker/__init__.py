"""The Tinker wire surface (`/api/v1`): the tinker SDK's protocol over the same services."""
