"""Images in: turning pictures into the pixel patches a vision tower reads, and the vision towers themselves."""
