"""nbgrader for a labkit class: the course id, the exchange, the course folder (from ROOT/class.json).

``classroom.py up`` copies this file into the instructor's course folder and the servers' config
(ROOT/etc/<role>), all under ROOT, so it finds the class's settings above itself.
"""

import json
from pathlib import Path

c = get_config()  # noqa: F821 (nbgrader defines it)
root = next(p for p in Path(__file__).resolve().parents if (p / "class.json").is_file())
settings = json.loads((root / "class.json").read_text(encoding="utf-8"))

c.CourseDirectory.course_id = settings["course_id"]
c.Exchange.root = str(root / "exchange")
# the instructor's course folder (the same in the students' config, who never read it)
c.CourseDirectory.root = str(root / "home" / settings["instructor"] / "course")
