"""The shop's projections (see the package docstring).

PostgreSQL views: ``CustomerTotals``, ``Customers``, ``CustomerActivity``, ``CustomerSessions``
(each customer's shopping sessions: orders less than 30 minutes apart, a session window). Search indexes and
Redis caches of the same tables, each declaring its sink (``sinks``) and that sink's options
(``sink_options``: search field mappings, Redis value format):

- ``ProductSearch`` (search alias ``product_search``): the catalogue, full text on name and
  description (English stemming: "boot" finds "boots"), exact ``category``;
- ``OrderSearch`` (alias ``order_search``): every order with status, amount and customer;
- ``OrderDocuments`` (alias ``order_documents``): every order joined with its customer's name and
  city and its product's name and category (lookups), full text on the product name; a renamed
  customer or product rewrites every document that carries it;
- ``CategoryRevenue`` (PostgreSQL view ``category_revenue``): orders and revenue per product
  category, grouped over orders joined with products (an order whose product moves category
  moves its revenue);
- ``CategoryHourlyRevenue`` (PostgreSQL view ``category_hourly_revenue``): orders and revenue per
  product category and hour, each order in the category its product had when the order changed
  (as-of enrichment feeding a tumbling window: a product moved later leaves past hours as they were);
- ``CustomerDocuments`` (Redis view ``customer_documents``, one JSON document per customer): the
  customer with the list of its orders (a nested collection), oldest first; an order added, changed,
  moved to another customer or deleted rewrites the documents it enters and leaves;
- ``CustomerCache`` (Redis view ``customer_cache``, one hash per customer): what a service
  reads with ``kappaflow.projections.sinks.redis.get(client, "customer_cache", 42)``;
- ``CustomerTotalsCache`` (PostgreSQL view and Redis hashes ``customer_totals_cache``): the
  customer's order totals in Redis. A grouped fold keeps its per-order state in PostgreSQL
  (to retract an order that moves or is deleted), so its Redis view mirrors the PostgreSQL
  view: sinks ("postgres", "redis").

Each is its own projection (own lock and positions per sink) and can be replayed and followed
independently of the PostgreSQL views: ``kappaflow replay examples.shop:ProductSearch`` needs
``[views.search] url``, the caches need ``[views.redis] url``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from kappaflow.projections import AsOf, Count, Event, Lookup, Max, Nested, Projection, Session, Sum, Tumbling


class CustomerTotals(Projection):
    """Per customer: number of orders, total amount, last order time (cancelled orders excluded).

    Retraction-aware: an order moved to another customer moves its amount, a cancelled or
    deleted order stops counting.
    """

    name = "customer_totals"
    sources = ["shop.public.orders"]
    key = ["customer_id"]
    where = "status <> 'cancelled'"
    aggregates = {
        "orders": Count(),
        "total_amount": Sum("amount"),
        "last_order_at": Max("created_at"),
    }


class CustomerSessions(Projection):
    """Per customer, its shopping sessions: orders placed less than 30 minutes apart form one session
    [first order, last order + 30 min), with its orders and revenue (cancelled orders excluded).

    An order placed late out of order between two sessions merges them; deleting or re-dating the
    order that bridged them splits them again (README "Session windows"). Changes to orders placed
    more than a day before the newest order of their log partition are late and go to the dead-letter
    topic.
    """

    name = "customer_sessions"
    sources = ["shop.public.orders"]
    key = ["customer_id"]
    where = "status <> 'cancelled'"
    window = Session("created_at", gap="30m", delay="5m", allowed_lateness="1d", late="dead_letter")
    aggregates = {"orders": Count(), "revenue": Sum("amount")}


class Customers(Projection):
    """The current row of every customer, with the e-mail domain derived."""

    name = "customers_view"
    sources = ["shop.public.customers"]
    key = ["id"]
    columns = ["id", "name", "email", "city"]
    derive = {"email_domain": "lower(substring_index(email, '@', -1))"}


class CustomerActivity(Projection):
    """A custom fold: how many changes each order went through and its last status."""

    name = "order_activity"
    sources = ["shop.public.orders"]
    key = ["id"]
    schema = "id bigint, customer_id bigint, changes bigint, last_status string"

    def apply(self, row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
        if event.op == "d":
            return None
        after = event.after or {}
        changes = (row["changes"] if row else 0) + 1
        return {"customer_id": after.get("customer_id"), "changes": changes, "last_status": after.get("status")}


# --- search indexes -------------------------------------------------------------------------------
class ProductSearch(Projection):
    """The product catalogue as a search index: match on name/description, filter on category."""

    name = "product_search"
    sources = ["shop.public.products"]
    key = ["id"]
    columns = ["id", "name", "description", "category", "price"]
    sinks: ClassVar[Sequence[str]] = ("search",)
    sink_options: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "search": {
            "fields": {
                "name": "text+keyword",  # full text, plus name.keyword for sorting and exact match
                "description": {"type": "text", "analyzer": "english"},
                "category": "keyword",
            },
        },
    }


class OrderSearch(Projection):
    """Orders as a search index: filter by status and customer, range over amount and time."""

    name = "order_search"
    sources = ["shop.public.orders"]
    key = ["id"]
    columns = ["id", "customer_id", "product_id", "amount", "status", "created_at"]
    sinks: ClassVar[Sequence[str]] = ("search",)
    sink_options: ClassVar[Mapping[str, Mapping[str, Any]]] = {"search": {"fields": {"status": "keyword"}}}


class OrderDocuments(Projection):
    """Orders as denormalised search documents: the order with its customer's name and city and its
    product's name and category, always as those rows are now (lookups into customers and products;
    the join state lives in the PostgreSQL views database, one per index build)."""

    name = "order_documents"
    sources = ["shop.public.orders"]
    key = ["id"]
    columns = ["id", "status", "amount", "created_at", "customer_id", "customer_name", "customer_city",
               "product_id", "product_name", "product_category"]
    lookups: ClassVar[Sequence[Lookup]] = [
        Lookup("customer", "shop.public.customers", on={"customer_id": "id"}, columns=["name", "city"]),
        Lookup("product", "shop.public.products", on={"product_id": "id"}, columns=["name", "category"]),
    ]
    sinks: ClassVar[Sequence[str]] = ("search",)
    sink_options: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "search": {
            "fields": {
                "product_name": "text+keyword",  # full text on the product name, exact match on .keyword
                "customer_name": "text+keyword",
                "customer_city": "keyword",
                "product_category": "keyword",
                "status": "keyword",
            },
        },
    }


class CategoryRevenue(Projection):
    """Orders and revenue per product category (cancelled orders excluded): grouped over orders joined
    with products, so an order moved to another product, or a product moved to another category,
    moves its revenue."""

    name = "category_revenue"
    sources = ["shop.public.orders"]
    key = ["product_category"]
    where = "status <> 'cancelled'"
    lookups: ClassVar[Sequence[Lookup]] = [
        Lookup("product", "shop.public.products", on={"product_id": "id"}, columns=["category"], how="inner"),
    ]
    aggregates = {"orders": Count(), "revenue": Sum("amount")}


class CategoryHourlyRevenue(Projection):
    """Orders and revenue per product category and hour the order was placed (cancelled orders
    excluded), each order in the category its product had when the order row last changed: as-of
    enrichment feeding a tumbling window (README "Windows over as-of rows"). Unlike
    ``CategoryRevenue`` (the current category), moving a product to another category later leaves
    the hours already counted as they were, and a replay gives the view the follower gave. Changes
    to orders placed more than a day before the newest order of their log partition are late and go
    to the dead-letter topic. The products' topic must keep every version (``keep_history``, as the
    demo's source has it)."""

    name = "category_hourly_revenue"
    sources = ["shop.public.orders"]
    key = ["product_category"]
    where = "status <> 'cancelled'"
    as_of: ClassVar[Sequence[AsOf]] = [
        AsOf("product", "shop.public.products", on={"product_id": "id"}, columns=["category"]),
    ]
    window = Tumbling("created_at", size="1h", delay="5m", allowed_lateness="1d", late="dead_letter")
    aggregates = {"orders": Count(), "revenue": Sum("amount")}


# --- Redis caches ---------------------------------------------------------------------------------
class CustomerDocuments(Projection):
    """Every customer as one JSON document with the list of its current orders (a nested collection,
    oldest first), what a service shows on a customer page with one read. The join state (customers
    and orders, current rows) lives in the PostgreSQL views database, one per key namespace build."""

    name = "customer_documents"
    sources = ["shop.public.customers"]
    key = ["id"]
    columns = ["id", "name", "email", "city", "orders"]
    nested: ClassVar[Sequence[Nested]] = [
        Nested("orders", "shop.public.orders", on={"id": "customer_id"},
               columns=["id", "product_id", "amount", "status", "created_at"], order_by=["created_at"]),
    ]
    sinks: ClassVar[Sequence[str]] = ("redis",)  # JSON documents (the Redis sink's default format)


class CustomerCache(Projection):
    """The current row of every customer as a Redis hash (readable with HGETALL by any client).

    No TTL: a view key is rewritten only when its customer changes, so an expiring key would
    be a cache miss until then; set ``ttl_s`` in ``sink_options["redis"]`` where that is fine.
    """

    name = "customer_cache"
    sources = ["shop.public.customers"]
    key = ["id"]
    columns = ["id", "name", "email", "city"]
    sinks: ClassVar[Sequence[str]] = ("redis",)
    sink_options: ClassVar[Mapping[str, Mapping[str, Any]]] = {"redis": {"value_format": "hash"}}


class CustomerTotalsCache(CustomerTotals):
    """``CustomerTotals`` also in Redis (one hash per customer: orders, total_amount,
    last_order_at), for services that read totals next to the customer cache.

    The Redis view mirrors the PostgreSQL one: replay copies it, follow copies the customers
    whose totals changed (moved, cancelled and deleted orders included)."""

    name = "customer_totals_cache"
    sinks: ClassVar[Sequence[str]] = ("postgres", "redis")
    sink_options: ClassVar[Mapping[str, Mapping[str, Any]]] = {"redis": {"value_format": "hash"}}
