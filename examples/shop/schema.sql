-- The shop's source tables (captured by kappaflow).
CREATE TABLE IF NOT EXISTS public.customers (
    id      bigint PRIMARY KEY,
    name    text NOT NULL,
    email   text NOT NULL,
    city    text
);
CREATE TABLE IF NOT EXISTS public.products (
    id           bigint PRIMARY KEY,
    name         text NOT NULL,
    description  text NOT NULL DEFAULT '',
    category     text NOT NULL,
    price        numeric(12,2) NOT NULL CHECK (price >= 0)
);
CREATE TABLE IF NOT EXISTS public.orders (
    id           bigint PRIMARY KEY,
    customer_id  bigint NOT NULL REFERENCES public.customers(id),
    product_id   bigint REFERENCES public.products(id),
    amount       numeric(12,2) NOT NULL,
    status       text NOT NULL DEFAULT 'new',
    created_at   timestamptz NOT NULL DEFAULT now()
);
