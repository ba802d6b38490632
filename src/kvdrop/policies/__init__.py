"""The built-in policies, one module each, named as ``kvdrop list`` shows them.

Each module holds a scorer dataclass (its fields are the policy's parameters, one ``score()``)
and the factory registered under the ``kvdrop.policies`` entry point (see ``pyproject.toml``).
Helpers they share live in :mod:`kvdrop.policies._common` and :mod:`kvdrop.attention`.
"""
