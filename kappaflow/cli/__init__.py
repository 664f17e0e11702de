def main() -> None:
    from kappaflow.cli.app import app
    app()
