"""Parts written outside kvtier, loaded by module path (``plugin_examples.dict_tier:DictTier``):
they use only kvtier's public interfaces, as a third-party package would."""
