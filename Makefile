# Thin aliases for ./dev, which bootstraps its own virtualenv (see README).
.PHONY: demo test bench lint
demo test bench lint:
	./dev $@
