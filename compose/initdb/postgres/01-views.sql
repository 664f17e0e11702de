-- The views database where projections write; the shop database is created by POSTGRES_DB.
CREATE DATABASE views OWNER kappaflow;
\connect shop
CREATE TABLE customers (id bigint PRIMARY KEY, name text NOT NULL, email text, created_at timestamptz DEFAULT now());
CREATE TABLE orders (id bigint PRIMARY KEY, customer_id bigint NOT NULL REFERENCES customers (id),
                     amount numeric(12, 2) NOT NULL, status text NOT NULL DEFAULT 'new',
                     created_at timestamptz DEFAULT now());
ALTER ROLE kappaflow WITH REPLICATION;
