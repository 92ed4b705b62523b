"""Live dashboards: Bokeh components over the telemetry log, as notebook widgets and served apps."""

from .live import Dashboard, dashboard
from .server import DashboardServer, PlotEntry, serve_dashboard

__all__ = ["Dashboard", "DashboardServer", "PlotEntry", "dashboard", "serve_dashboard"]
