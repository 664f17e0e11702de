-- The views database where projections write; the shop database is created by POSTGRES_DB.
CREATE DATABASE views OWNER kappaflow;
\connect shop
-- The shop's tables, as in examples/shop/schema.sql (captured by capture-shop).
CREATE TABLE customers (id bigint PRIMARY KEY, name text NOT NULL, email text NOT NULL, city text);
CREATE TABLE products (id bigint PRIMARY KEY, name text NOT NULL, description text NOT NULL DEFAULT '',
                       category text NOT NULL, price numeric(12, 2) NOT NULL CHECK (price >= 0));
CREATE TABLE orders (id bigint PRIMARY KEY, customer_id bigint NOT NULL REFERENCES customers (id),
                     product_id bigint REFERENCES products (id),
                     amount numeric(12, 2) NOT NULL, status text NOT NULL DEFAULT 'new',
                     created_at timestamptz NOT NULL DEFAULT now());
ALTER ROLE kappaflow WITH REPLICATION;
