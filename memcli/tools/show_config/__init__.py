"""`memcli show-config`: the resolved config and the sizes derived from it."""
