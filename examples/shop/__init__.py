"""Shop example: customers, products and orders in PostgreSQL -> views, search indexes, caches.

- ``projections``: ``CustomerTotals`` (orders grouped by customer: count, sum, last order,
  retraction-aware), ``Customers`` (latest row per customer), ``CustomerActivity`` (a
  custom Python fold), ``CustomerSessions`` (shopping sessions per customer: a 30-minute session
  window); ``ProductSearch``, ``OrderSearch`` and ``OrderDocuments`` (search
  indexes; the last joins orders with customers and products), ``CategoryRevenue`` (revenue per
  product category over a join), ``CategoryHourlyRevenue`` (revenue per product category and hour, the
  category as of each order change: as-of enrichment feeding a window), ``CustomerCache`` and
  ``CustomerDocuments`` (Redis; the latter a customer with the list of its orders);
- ``demo``: ``run_demo()`` runs the whole flow: a PostgreSQL (a private one when none is
  configured), the shop tables with data, ``source add``, ``capture --until-caught-up``,
  ``replay``, and prints the view.

    kappaflow replay examples.shop:CustomerTotals
"""

from examples.shop.projections import (
    CategoryHourlyRevenue,
    CategoryRevenue,
    CustomerActivity,
    CustomerCache,
    CustomerDocuments,
    Customers,
    CustomerSessions,
    CustomerTotals,
    OrderDocuments,
    OrderSearch,
    ProductSearch,
)

__all__ = [
    "CategoryHourlyRevenue",
    "CategoryRevenue",
    "CustomerActivity",
    "CustomerCache",
    "CustomerDocuments",
    "CustomerSessions",
    "CustomerTotals",
    "Customers",
    "OrderDocuments",
    "OrderSearch",
    "ProductSearch",
    "run_demo",
]


def run_demo(*args, **kwargs):
    """See ``examples.shop.demo.run_demo``."""
    from examples.shop.demo import run_demo as _run

    return _run(*args, **kwargs)
