"""Model families: everything that differs between SD1, SD2 and SDXL lives here."""
