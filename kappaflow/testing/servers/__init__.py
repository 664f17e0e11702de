"""Private real servers for tests and local runs: PostgreSQL, MariaDB, Redis, tansu (Kafka), osmem."""
