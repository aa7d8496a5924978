"""Task data and result filters (`Filter`, `ExcludeVars`)."""
