"""Command line interface (`kappaflow ...`)."""


def main() -> None:
    from kappaflow.cli.app import run

    run()
