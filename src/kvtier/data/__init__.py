"""Bundled data: the default ``kvtier simulate`` configuration and a synthetic Mooncake trace."""
