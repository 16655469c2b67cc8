# The two commands of the README. Each does its own setup.
.PHONY: test demo demo-stop lint bench

test:
	bash scripts/test.sh

demo:
	bash scripts/demo.sh

demo-stop:
	bash scripts/demo.sh stop

lint:
	.venv/bin/ruff check .
	.venv/bin/lint-imports --no-cache
	.venv/bin/mypy
