"""GET /dashboard (a static page: HTML and JavaScript, no build step) and GET
/dashboard/state (its JSON, from metrics/dashboard.py). Behind the API keys like every
route; the page asks for the key once and sends it as a Bearer token."""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from tokenserve.metrics.dashboard import DashboardState


def register_dashboard_routes(app: FastAPI, dashboard: DashboardState) -> None:
    page = resources.files("tokenserve.entrypoints.openai").joinpath("static/dashboard.html")
    html = page.read_text(encoding="utf-8")

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(html)

    @app.get("/dashboard/state")
    async def dashboard_state() -> JSONResponse:
        return JSONResponse(dashboard.state(), headers={"Cache-Control": "no-store"})
