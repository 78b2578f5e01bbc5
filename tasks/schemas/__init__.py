"""The params schema, one module per top-level section of a profile: a frozen dataclass per
section (and its sub-sections), each field with its default and, beside it, what it means.
tasks/config/params.py loads a profile into them (file:line errors) and checks what spans sections.
A stage's source deps hold the schema modules of the sections its contract declares only, so
editing one section's schema reruns the stages that read it (tests/test_dvc_yaml.py). This
file holds no code: it is no dep of any stage.
"""
