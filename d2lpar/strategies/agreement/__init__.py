"""Do the loss curves of every layout agree with one device? A GPT with dropout and padded
sequences of different lengths whose random numbers are placed by position (``model``), the rules
a parallel trainer must keep and their broken versions (``rules``), layouts by the course's parts
and by torch's API (``layouts``, ``runners``, ``torch_layouts``), and the checker that measures a
noise band on one device and says per layout "within the band" or "outside it from step k"
(``checker``)."""
