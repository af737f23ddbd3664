PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Test files run in this many processes (pytest-xdist; each file's tests stay in one, so module fixtures run once).
TEST_WORKERS ?= 2

.PHONY: venv demo demo-detection test lint clean

venv: $(STAMP)

# Rebuilt when a pin (pyproject.toml) or the install steps (this Makefile) change, or .venv is missing.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,coco,deepspeed,colossalai]'
	$(BIN)/python -m pip install -q --no-deps colossalai==0.5.0
	touch $(STAMP)

demo: venv demo-detection
	$(BIN)/memfit train configs/vit_shapes.py --work-dir work_dirs/demo
	$(BIN)/memfit plan configs/vit_shapes.py --gpu 4090 --top 10 --work-dir work_dirs/demo

SHAPES_COCO := data/shapes_coco/annotations/instances_train.json

$(SHAPES_COCO): $(STAMP)
	$(BIN)/memfit data shapes-coco --out data/shapes_coco --image-size 96 --num 2400

demo-detection: venv $(SHAPES_COCO)
	$(BIN)/memfit train configs/detection/fcos_r18_shapes-coco.py --work-dir work_dirs/demo_detection

test: venv
	$(BIN)/ruff check memfit tests benchmarks
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: venv
	$(BIN)/ruff check memfit tests benchmarks

clean:
	rm -rf $(VENV) work_dirs data/shapes_coco
