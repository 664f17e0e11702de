"""View sinks: PostgreSQL, OpenSearch/Elasticsearch and Redis."""
