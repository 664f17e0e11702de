"""View sinks: PostgreSQL, OpenSearch/Elasticsearch and Redis, one package per store.

``base.py`` is the contract, ``registry.py`` names every kind (settings, options, opener),
``document.py`` is the shared base of the stores that keep one document per key; see the README's
Layout section for the role of each module.
"""
