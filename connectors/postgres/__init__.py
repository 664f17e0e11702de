"""PostgreSQL connector: consistent snapshot plus pgoutput logical decoding."""
