"""A secondary tier outside kvtier written as a package: ``tier.py`` holds the class (which
declares ``kind = "box_tier"``, the package's name), this file hands it on. The config names it
``plugin_examples.box_tier:BoxTier`` (or ``plugin_examples.box_tier.tier:BoxTier``); a registry
over ``plugin_examples`` lists it as ``box_tier``."""

from plugin_examples.box_tier.tier import BoxTier, Options

__all__ = ["BoxTier", "Options"]
