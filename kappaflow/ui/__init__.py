"""The read-only status page served by ``kappaflow ui`` (``kappaflow.ui.app``)."""
