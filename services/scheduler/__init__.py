"""Global scheduler: instance registry, prefix index, routing policies, admission, degradation."""
