"""Built-in YAML configs, shipped inside the package as memcli.configs."""
